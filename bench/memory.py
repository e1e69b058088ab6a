"""Max per-device parameter bytes: autodist tp/fsdp, ideal, keras-hub static."""

from __future__ import annotations

import pathlib

import keras_hub_autodist
from bench import planning
from bench.static_maps import static_device_bytes
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.presets import read_preset_config
from keras_hub_autodist.registry import architecture_for
from keras_hub_autodist.shapes import architecture_weights

SHARED = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "presets"
DEVICES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def meshes(devices):
    """(batch, model) splits: model axis up to 8 (or 16 for 256), rest batch."""
    model = min(devices, 8 if devices < 256 else 16)
    return devices // model, model


def run():
    rows = []
    for preset in sorted(
        p
        for p in SHARED.iterdir()
        if (p / "config.json").exists() and p.name not in planning.PRESETS
    ):  # the 70B-class configs have their own section (bench/planning.py)
        info = read_preset_config(str(preset))
        try:
            weights = architecture_weights(
                architecture_for(info.backbone_cls), info.config, info.backbone_cls
            )
        except UnsupportedArchitectureError:
            # A config of a family with no architecture: listed as such.
            rows.append(
                dict(preset=preset.name, unsupported=info.backbone_cls.__name__)
            )
            continue
        for devices in DEVICES:
            batch, model = meshes(devices)
            mesh = {"batch": batch, "model": model}
            tp = keras_hub_autodist.plan(str(preset), mesh, strategy="tp")
            fsdp = keras_hub_autodist.plan(str(preset), mesh, strategy="fsdp")
            static, note = static_device_bytes(
                info.backbone_cls.__name__, weights, (batch, model)
            )
            rows.append(
                dict(
                    preset=preset.name,
                    devices=devices,
                    mesh=f"{batch}x{model}",
                    total=tp.total_bytes,
                    ideal=tp.total_bytes / devices,
                    tp=tp.max_device_bytes,
                    fsdp=fsdp.max_device_bytes,
                    static=static,
                    static_note=note,
                )
            )
    return rows


def plot(rows, out_dir, stamp):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = {
        "gemma": ["gemma_2b", "gemma_7b", "gemma2_2b", "gemma3_1b"],
        "llama": ["llama2_7b", "llama3_8b", "llama3.2_1b"],
    }
    paths = []
    for family, presets in families.items():
        fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.8))
        for ax, name in zip(axes, presets):
            data = [r for r in rows if r["preset"] == name]
            x = [r["devices"] for r in data]
            gib = 2**30
            ax.plot(x, [r["ideal"] / gib for r in data], "k--", label="ideal")
            ax.plot(x, [r["tp"] / gib for r in data], "o-", label="autodist tp")
            ax.plot(x, [r["fsdp"] / gib for r in data], "s-", label="autodist fsdp")
            ok = [(r["devices"], r["static"] / gib) for r in data if r["static"]]
            failed = [
                r["devices"]
                for r in data
                if r["static"] is None and "fails" in r["static_note"]
            ]
            if ok:
                ax.plot(*zip(*ok), "^-", label="keras-hub static map")
            for d in failed:
                ax.axvline(d, color="red", alpha=0.2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(
                name + (" (red: static map fails)" if failed else ""), fontsize=9
            )
            ax.set_xlabel("devices (batch x model, model <= 8, 16 at 256)")
            ax.set_ylabel("max GiB per device (f32)")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"Parameter bytes per device — {stamp}", fontsize=8)
        fig.tight_layout()
        path = out_dir / f"memory_{family}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
