"""After loading: each variable laid out as planned (`verify_layouts`).

The check of each variable's path and shape against the plan, as it is
created and once the model is built, is `weight_check.WeightCheck`.
"""

from __future__ import annotations

from keras_hub_autodist import compat
from keras_hub_autodist.errors import LayoutMismatchError


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
