"""Loading keras-hub's weights straight into their shards: byte ranges read in
parallel (`file_reads`), tensors read slice by slice (`lazy_tensors`,
`safetensors_header`), host buffers the devices adopt (`transfer`), the
loading session around keras-hub's own loader (`session`) and the checks of
the loaded model against its plan (`verify`).

`sharded_loading`, `attach_load_stats`, `load_stats` and `LoadStats` are the
session's, named here as well; they load on first use (PEP 562), so
importing one module of the stage imports no Keras.
"""

import importlib

_SESSION_NAMES = ("LoadStats", "attach_load_stats", "load_stats", "sharded_loading")

__all__ = list(_SESSION_NAMES)


def __getattr__(name):
    if name not in _SESSION_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.session"), name)
