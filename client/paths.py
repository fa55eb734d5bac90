"""Where things live in the checkout (``tandem.client`` is installed from it in
development mode): the model repository templates, the demo checkpoints, the cache."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"   # config.pbtxt templates `tandem serve` renders
DEMO_CHECKPOINTS = REPO_ROOT / "checkpoints" / "demo"  # target/, draft/, mtp/ once trained
CACHE = REPO_ROOT / ".cache"
DEMO_MODEL = "demo"   # --model demo: the demo target (also the default of tandem serve)
