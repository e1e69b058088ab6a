"""Machine, date and versions, stamped on every figure and table."""

import datetime
import os
import platform


def describe() -> str:
    import jax
    import keras
    import keras_hub

    import keras_hub_autodist

    cpu = platform.processor() or platform.machine()
    return (
        f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores ({cpu}), "
        f"{datetime.date.today().isoformat()}; python {platform.python_version()}, "
        f"jax {jax.__version__}, keras {keras.__version__}, keras-hub "
        f"{keras_hub.__version__}, keras-hub-autodist {keras_hub_autodist.__version__}"
    )
