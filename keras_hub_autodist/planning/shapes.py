"""The second step of the data path: every weight of the model a preset
builds, with its logical axes.

Shapes and paths come from the model keras-hub would build, built abstractly
from the config (`abstract.model_variables`: no weight is allocated), or
from an earlier process's build kept on disk: one source, the model itself.
Each variable is then matched against the family's rule table. A field the
family needs but the config lacks, and a weight dimension that is not a
positive integer, name the field and the preset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.registry import architecture_by_name
from keras_hub_autodist.architectures.registry import architecture_for
from keras_hub_autodist.architectures.weight import Weight
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.planning import abstract
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.reading.dtypes import loaded_policy
from keras_hub_autodist.reading.dtypes import mixed_policy
from keras_hub_autodist.reading.dtypes import variable_dtype
from keras_hub_autodist.reading.records import CONFIG_DICT
from keras_hub_autodist.reading.records import HF_CONFIG_DICT
from keras_hub_autodist.reading.records import PresetConfig


@dataclasses.dataclass(frozen=True)
class ModelWeights:
    """Every weight of a preset's model, ready to plan.

    Args:
        preset: what was read (a folder, handle, or a label).
        backbone_class: the backbone class name.
        architecture: the family whose rule table gave the logical axes.
        config_fields: logical axis → the config field that sets it.
        sequence_parallel_outputs: the family's residual-stream layer
            outputs (`<layer path>/output` patterns).
        dtype: the variable dtype the model will be loaded with.
        weights: one `Weight` (path, pattern, shape, logical axes) per
            variable, in the model's order.
        final_logit_soft_cap: the config's cap of the output logits
            (`cap · tanh(logits / cap)`, Gemma 2), or `None`.
        mixed_policy: the mixed-precision policy the model computes with
            (`"mixed_bfloat16"`: float32 variables), or `""`.
    """

    preset: str
    backbone_class: str
    architecture: str
    config_fields: Mapping[str, str]
    sequence_parallel_outputs: tuple[str, ...]
    dtype: str
    weights: tuple[Weight, ...]
    final_logit_soft_cap: float | None = None
    mixed_policy: str = ""


def architecture_of(preset_config: PresetConfig) -> Architecture:
    """The architecture (rule table) of the preset's backbone class.

    Example:
    ```python
    architecture_of(read_config("./gemma_2b")).name  # 'gemma'
    ```
    """
    if preset_config.backbone_cls is not None:
        return architecture_for(preset_config.backbone_cls)
    name = preset_config.backbone_class
    architecture = architecture_by_name(name)
    if architecture is not None:
        return architecture
    # Not registered by name: keras-hub's class, whose base classes may have
    # an architecture (`architecture_for` walks its MRO).
    try:
        backbone_cls = backbone_class_named(name)
    except ConfigError as error:
        if preset_config.preset not in (CONFIG_DICT, HF_CONFIG_DICT):
            raise
        raise PlanInputError(
            f"keras-hub has no backbone class named {name!r}. Give the class "
            "itself, {'class_name': MyBackbone, 'config': ...}, or pass the "
            f"backbone instance. Received: class_name={name!r} in "
            f"preset={preset_config.preset!r}"
        ) from error
    return architecture_for(backbone_cls)


def model_weights(preset_config: PresetConfig, options: PlanOptions) -> ModelWeights:
    """Every weight of the model `preset_config` builds, with logical axes.

    Args:
        preset_config: the config read from the preset.
        options: the plan's options (`strict`, `dtype`,
            `sequence_parallel`).

    Example:
    ```python
    model = model_weights(read_config("./gemma_2b"), PlanOptions())
    model.weights[0].path
    ```
    """
    architecture = architecture_of(preset_config)
    outputs = tuple(architecture.sequence_parallel_outputs or ())
    if options.sequence_parallel and not outputs:
        raise UnsupportedArchitectureError(
            f"keras_hub_autodist has no sequence-parallel layout for the "
            f"{architecture.name!r} family ({preset_config.backbone_class}): "
            "its architecture lists no `sequence_parallel_outputs`. Load it "
            "without `sequence_parallel=True`. Received: sequence_parallel=True"
        )
    fields = dict(architecture.config_fields)
    validate_config(preset_config, [*fields.values(), "num_layers"])
    weights = validated_weights(architecture, preset_config, fields, options)
    return ModelWeights(
        preset=str(preset_config.preset),
        backbone_class=preset_config.backbone_class,
        architecture=architecture.name,
        config_fields=fields,
        sequence_parallel_outputs=outputs,
        dtype=variable_dtype(
            preset_config.config, built_policy(preset_config, options)
        ),
        weights=tuple(weights),
        final_logit_soft_cap=preset_config.config.get("final_logit_soft_cap"),
        mixed_policy=mixed_policy(
            preset_config.config, built_policy(preset_config, options)
        ),
    )


def built_policy(preset_config: PresetConfig, options: PlanOptions):
    """The dtype policy the model of `preset_config` is built with, by
    keras-hub's rule (`reading.dtypes.loaded_policy`): what the plan, its
    bytes and the abstract build of the memory check all read.

    Example:
    ```python
    built_policy(read_config("./gemma_2b"), PlanOptions())  # 'float32'
    ```
    """
    # Config dicts and instances are labelled "<...>": they keep their dtype.
    preset_files = not str(preset_config.preset).startswith("<")
    return loaded_policy(preset_config.config, options.dtype, preset_files=preset_files)


def backbone_class_named(name: str) -> type:
    """The keras-hub backbone class registered under `name`.

    Example:
    >>> backbone_class_named("GemmaBackbone").__name__
    'GemmaBackbone'
    """
    import keras
    import keras_hub

    found = keras.saving.get_registered_object(f"keras_hub>{name}")
    if found is None:
        found = getattr(keras_hub.models, name, None)
    if found is None:  # another package's backbone, registered with Keras
        registered = keras.saving.get_custom_objects()
        found = next(
            (obj for key, obj in registered.items() if key.endswith(f">{name}")),
            None,
        )
    if not isinstance(found, type):
        raise ConfigError(
            f"keras-hub has no backbone class named {name!r}. Check the "
            "preset's config.json `class_name` (or upgrade keras-hub). "
            f"Received: class_name={name!r}"
        )
    return found


def _shapes(architecture, preset_config: PresetConfig, options: PlanOptions):
    config = preset_config.config
    architecture.check_config(config)  # refuse before building anything
    name = preset_config.backbone_class
    if preset_config.backbone_cls is None:
        # An earlier process's abstract build of this config, without keras.
        stored = abstract.stored_variables(name, config)
        if stored is not None:
            return architecture.match_variables(stored, name, strict=options.strict)
    backbone_cls = preset_config.backbone_cls or backbone_class_named(name)
    return architecture_weights(
        architecture, config, backbone_cls, strict=options.strict
    )


def architecture_weights(
    architecture: Architecture, config: Mapping, backbone_cls: type, *, strict=True
) -> list[Weight]:
    """Every variable of `backbone_cls` built (abstractly) from `config`, with
    the logical axes of the rule of `architecture` it matches.

    Args:
        architecture: the family's architecture (rule table).
        config: the backbone's constructor arguments.
        backbone_cls: the keras-hub backbone class.
        strict: a variable that matches no rule is an error (`True`), or a
            warning and the variable stays replicated (`False`).

    Raises:
        UnplannedWeightError: a variable matches several rules, or (when
            `strict`) none.

    Example:
    ```python
    weights = architecture_weights(GEMMA, config, keras_hub.models.GemmaBackbone)
    ```
    """
    architecture.check_config(config)  # refuse before building anything
    return architecture.match_variables(
        abstract.model_variables(backbone_cls, config),
        backbone_cls.__name__,
        strict=strict,
    )


def validated_weights(
    architecture, preset_config: PresetConfig, fields: Mapping, options: PlanOptions
):
    """The weights of the preset's model, with config problems as `ConfigError`.

    Shapes and paths come from the model built abstractly from the config,
    or from an earlier process's build kept on disk. A field the family
    needs but the config lacks, and a weight with a dimension that is not a
    positive integer, name the field and the preset.

    Args:
        architecture: the architecture.
        preset_config: the config read from the preset.
        fields: the architecture's `config_fields` (logical axis → config
            field).
        options: the plan's options (`strict`).
    """
    config = preset_config.config
    try:
        weights = _shapes(architecture, preset_config, options)
    except KeyError as error:
        raise _missing_field_error(architecture, preset_config, error) from error
    except ConfigError as error:
        # keras-hub could not build the model: name a size the family reads
        # that the config leaves null.
        unset = [f for f in fields.values() if f in config and config[f] is None]
        if not unset:
            raise
        raise ConfigError(
            f"The preset's config leaves `{unset[0]}` null, which sizes the "
            f"{architecture.name} weights: it must be a positive integer. Fix "
            f"`{unset[0]}` in the preset's config.json. "
            + config_received(preset_config, unset[0], None)
        ) from error
    _check_positive_dims(weights, preset_config, fields)
    return weights


def _missing_field_error(architecture, preset_config, error: KeyError) -> ConfigError:
    field = error.args[0] if error.args else "?"
    return ConfigError(
        f"The preset's config has no `{field}`, which the "
        f"{architecture.name} layout needs. Add it to the preset's "
        f"config.json. Received: preset={str(preset_config.preset)!r}, "
        f"fields={sorted(preset_config.config)}"
    )


def _check_positive_dims(weights, preset_config: PresetConfig, fields) -> None:
    config = preset_config.config
    for weight in weights:
        for size, axis in zip(weight.shape, weight.logical_axes):
            if not is_positive_int(size):
                field = fields.get(axis, axis)
                raise ConfigError(
                    f"The preset's config gives weight {weight.path!r} the "
                    f"shape {weight.shape}: its {axis} dimension (from "
                    f"`{field}`) must be a positive integer. Fix `{field}` in "
                    "the preset's config.json. "
                    + config_received(preset_config, field, config.get(field))
                )


def is_positive_int(value) -> bool:
    """True for an `int` above 0 (not a `bool`).

    Example:
    >>> is_positive_int(3), is_positive_int(True)
    (True, False)
    """
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def config_received(preset_config: PresetConfig, field: str, value) -> str:
    """The `Received:` part of a message about a config field."""
    return f"Received: {field}={value!r} in preset={str(preset_config.preset)!r}"


# Upper bounds of the structural fields, far above any released model (the
# deepest has ~130 layers; the widest vocabularies ~260k), so that a typo
# such as 10**6 layers is an error rather than minutes of planning.
FIELD_LIMITS = {"num_layers": 10_000}
DEFAULT_FIELD_LIMIT = 2**24


def validate_config(preset_config: PresetConfig, fields) -> None:
    """Check the config fields an architecture uses before planning.

    Every field in `fields` that is set (not `None`) must be a positive
    integer within `FIELD_LIMITS` (else `DEFAULT_FIELD_LIMIT`), and
    `num_query_heads` must be a multiple of `num_key_value_heads`, as
    keras-hub's attention layers require.

    Args:
        preset_config: the config read from the preset.
        fields: the names of the structural fields (e.g. `num_layers`,
            `hidden_dim`) of the architecture.

    Raises:
        ConfigError: naming the field, its value and the preset.

    Example:
    >>> info = PresetConfig("./p", None, {"num_layers": -1}, "keras", "X")
    >>> validate_config(info, ["num_layers"])
    Traceback (most recent call last):
    ...
    keras_hub_autodist.errors.ConfigError: The preset's config has `num_layers=-1`; it must be a positive integer. Fix the preset's config.json. Received: num_layers=-1 in preset='./p'
    """  # noqa: E501
    config = preset_config.config
    if not isinstance(config, Mapping):
        raise ConfigError(
            "A backbone config is a mapping of constructor arguments. "
            f"Received: config={config!r} in preset={preset_config.preset!r}"
        )
    for field in fields:
        value = config.get(field)
        if value is not None and not is_positive_int(value):
            raise ConfigError(
                f"The preset's config has `{field}={value!r}`; it must be a "
                "positive integer. Fix the preset's config.json. "
                + config_received(preset_config, field, value)
            )
        limit = FIELD_LIMITS.get(field, DEFAULT_FIELD_LIMIT)
        if value is not None and value > limit:
            raise ConfigError(
                f"The preset's config has `{field}={value}`, more than the "
                f"{limit:,} any real model has; planning it would build that "
                "many weights. Fix the preset's config.json. "
                + config_received(preset_config, field, value)
            )
    heads = config.get("num_query_heads")
    kv_heads = config.get("num_key_value_heads")
    if is_positive_int(heads) and is_positive_int(kv_heads) and heads % kv_heads:
        raise ConfigError(
            f"`num_query_heads={heads}` is not a multiple of "
            f"`num_key_value_heads={kv_heads}`: each key/value head serves a "
            "whole group of query heads in keras-hub's attention. Fix the "
            "preset's config.json. "
            + config_received(preset_config, "num_key_value_heads", kv_heads)
        )
