"""`WeightCheck`: a model's variables against the plan made for it.

Each variable, as it is created and once the model is built, must match
exactly one layout-map key and have its planned shape. `from_preset` checks
every variable this way while it loads; `LayoutPlan.weight_check()` gives
the same check for your own scope.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from keras_hub_autodist.architectures.base import unplanned_weight_error
from keras_hub_autodist.architectures.base import warn_unplanned
from keras_hub_autodist.errors import UnplannedWeightError
from keras_hub_autodist.errors import WeightShapeError
from keras_hub_autodist.options import check_strict
from keras_hub_autodist.plan_record import PlanRecord
from keras_hub_autodist.weight import Weight


class WeightCheck:
    """Checks a built model's variables against a plan's layout-map keys.

    Every weight must match exactly one key of `plan.layout_map()` (the
    rules), as Keras' `LayoutMap` matches them: an exact key first, else the
    keys that `re.fullmatch` the path. A weight that no key matches would be
    replicated silently by `ModelParallel`; one that matches several makes
    Keras fail. A weight planned by path must be built with the planned
    shape.

    Build one with `LayoutPlan.weight_check()`, or directly from a plan.

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

    def __init__(self, plan: PlanRecord, *, strict: bool = True):
        check_strict(strict)
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
