"""A request's input tensors as numpy arrays, the way the request parsers read them."""
from __future__ import annotations

from typing import Callable

import numpy as np
import triton_python_backend_utils as pb_utils


def input_getter(request) -> Callable[[str], "np.ndarray | None"]:
    """``get(name)``: the named input as an array, or None when the client left it out."""
    def get(name: str):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()
    return get
