"""Readiness and the repository API of a running tritonserver, over plain HTTP
(no tritonclient import: the supervisor runs beside every server).

>>> api = TritonHTTP("127.0.0.1:8000")                       # doctest: +SKIP
>>> api.unload("prefill"); api.load("prefill")               # doctest: +SKIP
>>> api.server_ready(), api.model_ready("tandem")            # doctest: +SKIP
(True, True)
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tandem.client.serve.admin_key import HEADER
from tandem.client.serve.options import ServerError


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` answers 200 (a refused connection is not ready)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(frozen=True, slots=True)
class TritonHTTP:
    url: str    # host:port of the HTTP endpoint
    admin_key: str = field(default="", repr=False)   # sent on the control APIs (admin_key.py)

    def server_ready(self) -> bool:
        return http_ok(f"http://{self.url}/v2/health/ready")

    def model_ready(self, model: str) -> bool:
        return http_ok(f"http://{self.url}/v2/models/{model}/ready")

    def model_config(self, model: str) -> dict:
        with urllib.request.urlopen(f"http://{self.url}/v2/models/{model}/config", timeout=10) as r:
            return json.loads(r.read())

    def _index_entries(self) -> list[dict]:
        return json.loads(self._post("/v2/repository/index", timeout_s=10))

    def index(self) -> dict[str, tuple[str, str]]:
        """``{model: (state, reason)}`` from the repository index."""
        return {m["name"]: (m.get("state", ""), m.get("reason", "")) for m in self._index_entries()}

    def states(self) -> dict[str, set[str]]:
        """``{model: the states of its versions}`` from the repository index (during a
        version roll one version is READY while the other loads or unloads)."""
        out: dict[str, set[str]] = {}
        for m in self._index_entries():
            out.setdefault(m["name"], set()).add(m.get("state", ""))
        return out

    def load(self, model: str, timeout_s: float = 300.0, config: dict | None = None) -> None:
        """Load ``model`` (blocks until Triton loaded it); raises ServerError with Triton's
        reason. With ``config`` (a model config, as :meth:`model_config` returns it) a
        loaded model is loaded again even though its files did not change."""
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        self._post(f"/v2/repository/models/{model}/load", timeout_s=timeout_s, body=body)

    def unload(self, model: str, timeout_s: float = 30.0) -> None:
        """Ask Triton to unload ``model`` (it returns at once; the instance goes when idle)."""
        self._post(f"/v2/repository/models/{model}/unload", timeout_s=timeout_s)

    def _post(self, path: str, timeout_s: float, body: dict | None = None) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self.admin_key:
            headers[HEADER] = self.admin_key
        req = urllib.request.Request(f"http://{self.url}{path}", data=json.dumps(body or {}).encode(),
                                     method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            try:
                body = json.loads(body).get("error", body)
            except ValueError:
                pass
            raise ServerError(f"POST {path}: {e.code} {body}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"POST {path}: {e}") from None
