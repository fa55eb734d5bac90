"""Where things live in the checkout (``tandem.client`` is installed from it in
development mode): the model repository templates, the demo checkpoints, the cache."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"   # config.pbtxt templates `tandem serve` renders
DEMO_CHECKPOINTS = REPO_ROOT / "checkpoints" / "demo"  # target/, draft/, mtp/ once trained
CACHE = REPO_ROOT / ".cache"
# a target's default proposers, in order of preference: the first that fits it serves it
# (tandem.backends.speculative.fit.first_fitting); checkpoints/smollm2/mtp: SmolLM2-135M-Instruct's
DEFAULT_PROPOSERS = {"draft_model": (DEMO_CHECKPOINTS / "draft",),
                     "mtp_head": (REPO_ROOT / "checkpoints" / "smollm2" / "mtp", DEMO_CHECKPOINTS / "mtp")}
DEMO_MODEL = "demo"   # --model demo: the demo target (also the default of tandem serve)
