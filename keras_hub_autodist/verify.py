"""Every check of a built or loaded model against its plan.

- `WeightCheck`: each variable, as it is created and once the model is
  built, matches exactly one layout-map key and has its planned shape.
- `verify_layouts`: each loaded variable is laid out as planned.
- `unplanned_weight_error` / `warn_unplanned`: the one message for weights
  that match no rule or several, used here and by the architectures'
  rule tables on the abstract build.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING
from typing import Any

from keras_hub_autodist import compat
from keras_hub_autodist.errors import LayoutMismatchError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.errors import UnplannedWeightError
from keras_hub_autodist.errors import UnplannedWeightWarning
from keras_hub_autodist.errors import WeightShapeError
from keras_hub_autodist.errors import option

if TYPE_CHECKING:
    from keras_hub_autodist.plan import LayoutPlan
    from keras_hub_autodist.weight import Weight

DOCS_ADDING_AN_ARCHITECTURE = "docs/architectures.md#adding-an-architecture"


def unplanned_weight_error(
    backbone_class: str,
    architecture: str,
    unmatched: list[str],
    ambiguous: dict[str, list[str]],
    *,
    planned_from: str = "",
) -> UnplannedWeightError:
    """The error for weights that match no rule of their architecture's
    table (`unmatched`, as `"path shape"`) or several (`ambiguous`: path →
    the patterns it matches).

    Example:
    >>> error = unplanned_weight_error("GemmaBackbone", "gemma", ["x (2,)"], {})
    >>> str(error).split(":")[0]
    "1 weights of GemmaBackbone match no rule of the 'gemma' architecture"
    """
    source = f" (planned from {planned_from})" if planned_from else ""
    parts = []
    if unmatched:
        parts.append(
            f"{len(unmatched)} weights of {backbone_class} match no rule of "
            f"the {architecture!r} architecture{source}: "
            + ", ".join(unmatched[:10])
            + ". Add a rule for them to the architecture's table (see "
            f"{DOCS_ADDING_AN_ARCHITECTURE}), or pass "
            f"{option('strict', 'False')} to keep them replicated"
        )
    if ambiguous:
        listed = "; ".join(
            f"{path} matches {patterns}"
            for path, patterns in list(ambiguous.items())[:5]
        )
        parts.append(
            f"{len(ambiguous)} weights of {backbone_class} match several "
            f"rules of the {architecture!r} architecture{source} ({listed}). "
            "Make the rules disjoint"
        )
    return UnplannedWeightError(
        ". ".join(parts)
        + f". Received: {len(unmatched)} unmatched, {len(ambiguous)} ambiguous"
    )


def warn_unplanned(backbone_class: str, architecture: str, unmatched) -> None:
    """Warn (`UnplannedWeightWarning`) that `unmatched` weights (`"path
    shape"`) stay replicated because `strict=False`."""
    warnings.warn(
        f"keras_hub_autodist: {len(unmatched)} weights of {backbone_class} "
        f"match no rule of the {architecture!r} architecture and stay "
        f"replicated on every device (strict=False): {', '.join(unmatched[:10])}",
        UnplannedWeightWarning,
        stacklevel=4,
    )


class WeightCheck:
    """Checks a built model's variables against a plan's layout-map keys.

    Every weight must match exactly one key of `plan.layout_map()` (the
    rules), as Keras' `LayoutMap` matches them: an exact key first, else the
    keys that `re.fullmatch` the path. A weight that no key matches would be
    replicated silently by `ModelParallel`; one that matches several makes
    Keras fail. A weight planned by path must be built with the planned
    shape.

    Build one with `LayoutPlan.weight_check()`.

    Args:
        plan: the `LayoutPlan`.
        strict: whether unmatched weights are an error (`True`) or a
            warning, the weights staying replicated (`False`).

    Example:
    ```python
    check = plan.weight_check(strict=False)
    check.created("decoder_block_0/attention/query/kernel", (8, 2048, 256))
    check.built(backbone.weights)  # warns for unplanned weights
    ```
    """

    def __init__(self, plan: LayoutPlan, *, strict: bool = True):
        if not isinstance(strict, bool):
            raise PlanError(
                "`strict` is True (a weight that no layout rule matches is an "
                "error) or False (a warning; the weight stays replicated). "
                f"Received: strict={strict!r}"
            )
        self.plan = plan
        self.strict = strict
        self._keys = list(plan.weight_layouts())
        self._key_set = set(self._keys)
        self._compiled = [re.compile(key) for key in self._keys]
        self._rows = {row.path: row for row in plan.rows}
        # Layout key -> the planned rows it covers, to check weights whose
        # paths differ from the abstract build's (blocks that keras-hub names
        # from a process-wide counter, as in its MoE families).
        self._key_rows: dict[str, list[Weight]] = {}
        for row in plan.rows:
            key = row.pattern if row.pattern in self._key_set else re.escape(row.path)
            self._key_rows.setdefault(key, []).append(row)

    def planned_row(self, path: str) -> Weight | None:
        """The planned row of `path`: by path, else the rows of its one
        matching key when they all have one shape."""
        row = self._rows.get(path)
        if row is not None:
            return row
        keys = self.matching_keys(path)
        rows = self._key_rows.get(keys[0], []) if len(keys) == 1 else []
        if rows and len({r.shape for r in rows}) == 1:
            return rows[0]
        return None

    def matching_keys(self, path: str) -> list[str]:
        """The layout-map keys that match `path`, as Keras' `LayoutMap`
        matches them: an identical key alone, else every key that
        `re.fullmatch`es it."""
        if path in self._key_set:
            return [path]
        return [k for k, c in zip(self._keys, self._compiled) if c.fullmatch(path)]

    def created(self, path: str, shape: Iterable[int]) -> None:
        """Check one variable as it is created, before it is laid out.

        Raises:
            WeightShapeError: its path is planned with another shape.
            UnplannedWeightError: its path matches several keys.
        """
        shape = tuple(int(size) for size in shape)
        row = self.planned_row(path)
        if row is not None and row.shape != shape:
            raise self._shape_error(row, shape, path)
        keys = self.matching_keys(path)
        if len(keys) > 1:
            raise self._unplanned_error([], {path: keys})

    def built(self, variables: Iterable[Any]) -> list[str]:
        """Check every variable of a built model (objects with `.path` and
        `.shape`, e.g. `model.weights`).

        Returns:
            The paths of the weights that match no key (replicated), when
            `strict=False`.

        Raises:
            WeightShapeError: a planned weight has another shape.
            UnplannedWeightError: a weight matches several keys, or (when
                `strict`) none.
        """
        unmatched, ambiguous = [], {}
        for variable in variables:
            path = variable.path
            shape = tuple(int(size) for size in variable.shape)
            row = self.planned_row(path)
            if row is not None and row.shape != shape:
                raise self._shape_error(row, shape, path)
            keys = self.matching_keys(path)
            if not keys:
                unmatched.append(f"{path} {shape}")
            elif len(keys) > 1:
                ambiguous[path] = keys
        if ambiguous or (unmatched and self.strict):
            raise self._unplanned_error(unmatched, ambiguous)
        if unmatched:
            warn_unplanned(self.plan.backbone_class, self.plan.architecture, unmatched)
        return [entry.split(" ")[0] for entry in unmatched]

    def _unplanned_error(self, unmatched, ambiguous) -> UnplannedWeightError:
        return unplanned_weight_error(
            self.plan.backbone_class,
            self.plan.architecture,
            unmatched,
            ambiguous,
            planned_from=self.plan.preset,
        )

    def _shape_error(self, row: Weight, shape: tuple, path: str) -> WeightShapeError:
        differs = []
        if len(shape) == len(row.shape):
            for index, (planned, built) in enumerate(zip(row.shape, shape)):
                if planned != built:
                    axis = row.logical_axes[index]
                    field = self.plan.config_fields.get(axis)
                    source = f", set by `{field}`" if field else ""
                    differs.append(
                        f"dimension {index} ({axis}{source}): planned "
                        f"{planned}, built {built}"
                    )
        detail = f" ({'; '.join(differs)})" if differs else ""
        return WeightShapeError(
            f"Weight {path!r} of {self.plan.backbone_class} is built with "
            f"shape {shape}, but the plan, made from the config of "
            f"{self.plan.preset}, gives it {row.shape}{detail}. The model is "
            "being built from another config than the one planned: most "
            "likely the preset's task.json holds a backbone config that "
            "disagrees with its config.json (keras-hub builds a task from "
            "task.json). Make the two agree, e.g. save the model again with "
            "`save_to_preset`. Received: "
            f"built shape {shape}, planned shape {row.shape} for {path!r}"
        )


def verify_layouts(model) -> None:
    """Raise `LayoutMismatchError` if a variable is not laid out as planned.

    Args:
        model: a model whose variables were created under a distribution.

    Example:
    ```python
    verify_layouts(lm)  # after from_preset(..., device_mesh=mesh)
    ```
    """
    wrong = []
    for variable in model.variables:
        layout = compat.variable_layout(variable)
        if layout is None:
            continue
        expected = getattr(layout, "backend_layout", layout)
        actual = getattr(variable.value, "sharding", None)
        ndim = len(variable.shape)
        if actual is None or not actual.is_equivalent_to(expected, ndim):
            wrong.append(f"{variable.path}: {actual} (planned {expected})")
    if wrong:
        raise LayoutMismatchError(
            f"{len(wrong)} variables are not laid out as planned; this is a "
            "keras_hub_autodist bug, please report it with the preset's "
            f"config.json. Received: {'; '.join(wrong[:5])}"
        )
