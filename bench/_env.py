"""Environment every benchmark runs in: offline, quiet, CPU DeepSpeed, in-process vLLM,
local Ray without token auth. Imported first by each script in bench/."""
from __future__ import annotations

import os
import warnings

warnings.filterwarnings("ignore")
for key, value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "RAY_AUTH_MODE": "disabled",
}.items():
    os.environ.setdefault(key, value)

import transformers  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
