"""The ``prefill`` model: each job (``input_ids`` and the destination descriptor that
kv_transfer returned) is taken at once and acked (``prefill_ack``): the decoder learns
that the KV arrived from its reservation's counter, not from this model.

It has one of two roles, fixed by its config (:func:`prefill_model_for` picks):

- :class:`~.prefill_local.LocalPrefillModel` — chunked prefill of ``input_ids[:-1]``
  in this process, streaming each layer's KV into the decoder's reservation;
- :class:`~.prefill_remote.RemotePrefillModel` — with the ``prefill_endpoints``
  parameter (``tandem serve --prefill-endpoints``) it computes nothing and forwards
  each job to the ``prefill`` model of a prefill server (``tandem serve --mode
  prefill``), which streams the KV over UCX straight into this server's pages.

A descriptor is hostile until checked: it is parsed within fixed limits (no plan is
built) before either role sees it, and the local role holds it against its own pools
before the job is accepted; a forged one is refused with INVALID_ARG, and one that
names another request's reservation without its secret is refused by the receiver,
which ends only that transfer (and with it this prefill).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .settings import EngineSettings

if TYPE_CHECKING:   # the roles import Triton's utilities: only a stub loads them
    from .prefill_base import PrefillModel


def prefill_model_for(args: dict) -> PrefillModel:
    """The role the model's config asks for (not yet initialized)."""
    s = EngineSettings.from_model_config(json.loads(args["model_config"]))
    if s.prefill_endpoints:
        from .prefill_remote import RemotePrefillModel
        return RemotePrefillModel()
    # imported only here: the remote role loads neither torch nor the engine
    from .prefill_local import LocalPrefillModel
    return LocalPrefillModel()
