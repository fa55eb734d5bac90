"""Render Tandem's model repository: copy ``model_repository/`` (the models a mode
serves) into a run directory with each ``config.pbtxt``'s ``${name}`` placeholders
filled from :meth:`ServeOptions.template_values <tandem.client.serve.options.ServeOptions.template_values>`,
and each alias (``tandem serve --ensemble-name``) as a copy of its ensemble under the new name.

>>> render_repository(run_dir / "model_repository", options.template_values(),  # doctest: +SKIP
...                   models=options.models, aliases=options.aliases)
"""
from __future__ import annotations

import re
import shutil
import string
from pathlib import Path

from tandem.client.paths import MODEL_REPOSITORY
from tandem.client.serve.options import ServerError


def render_repository(dst: Path, values: dict[str, str], src: Path = MODEL_REPOSITORY,
                      models: tuple[str, ...] | None = None, aliases: dict[str, str] | None = None) -> Path:
    """Copy ``src`` (only ``models``, default all) to ``dst`` with each config.pbtxt's
    ``${name}`` placeholders filled; ``aliases`` (``{name: model}``) serve a model's
    config a second time under another name."""
    if dst.exists():
        shutil.rmtree(dst)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    ignore = skip if models is None else (
        lambda d, names: set(skip(d, names)) | ({n for n in names if n not in models}
                                                if Path(d) == Path(src) else set()))
    shutil.copytree(src, dst, ignore=ignore)
    for config in dst.glob("*/config.pbtxt"):
        try:
            text = string.Template(config.read_text()).substitute(values)
        except KeyError as exc:
            raise ServerError(f"{config.relative_to(dst)}: no value for placeholder ${{{exc.args[0]}}}") from None
        except ValueError as exc:  # a stray "$"; write "$$" for a literal one
            raise ServerError(f"{config.relative_to(dst)}: {exc}") from None
        config.write_text(text)
    for alias, model in (aliases or {}).items():
        if not (dst / model).is_dir():
            raise ServerError(f"{alias} would serve {model}, which this repository does not hold")
        shutil.copytree(dst / model, dst / alias)
        config = dst / alias / "config.pbtxt"
        text, n = re.subn(rf'^name: "{re.escape(model)}"$', f'name: "{alias}"', config.read_text(), flags=re.M)
        if n != 1:
            raise ServerError(f"{model}/config.pbtxt: no name line to replace for {alias}")
        config.write_text(text)
    return dst
