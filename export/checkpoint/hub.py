"""`--target` / `--draft` as a Hugging Face repo id: resolved to a snapshot directory through huggingface_hub.

A local path that exists always wins. Otherwise an argument shaped like a repo id (``name`` or ``org/name``)
is handed to ``huggingface_hub.snapshot_download``, which returns the snapshot of ``refs/main`` in the hub
cache (``models--org--name/snapshots/<commit>/``) and, when online, first downloads what is missing.
``HF_HUB_OFFLINE`` set: cache only (``local_files_only``), and a repo not in the cache is a one-line error.

The cache location and ``HF_HUB_OFFLINE`` are read from the environment when the argument is resolved
(``HF_HUB_CACHE``, else ``HF_HOME``/hub, else huggingface_hub's default), with huggingface_hub's own rules;
huggingface_hub itself reads them once, at import, which in a long-lived process may be before they were set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from eagle_export.errors import CheckpointError

# Online, what the loaders read is fetched and nothing else: first configs, tokenizer files and weight indexes,
# then one set of weights in transformers' order of preference (see ``fetch_weights``).
CONFIG_AND_TOKENIZER = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
WEIGHTS = (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model.bin"))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/ON/YES/TRUE, any case)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.upper() in constants.ENV_VARS_TRUE_VALUES


def hub_cache_dir() -> Path:
    """The hub cache directory: HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else the default."""
    from huggingface_hub import constants

    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def is_repo_id(text: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(arg: str | Path, option: str, progress: bool = True) -> Path:
    """The directory ``arg`` names: itself when it exists (or cannot be a repo id: the loader then says what is
    wrong with it), else the cached snapshot of the Hugging Face repo ``arg``. ``option`` (``--target``)
    is named in the errors."""
    path = Path(arg).expanduser()
    text = str(arg)
    if path.exists() or not is_repo_id(text):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    offline, cache = hub_offline(), hub_cache_dir()
    where = f"{option} {text}: no such directory, and"
    bars_were_off = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        if offline:
            snap = Path(snapshot_download(text, cache_dir=cache, local_files_only=True))
        else:
            snap = fetch_weights(lambda patterns: Path(snapshot_download(text, cache_dir=cache,
                                                                         allow_patterns=patterns)))
    except LocalEntryNotFoundError as e:
        if offline:
            raise CheckpointError(
                f"{where} the Hugging Face cache {cache} holds no snapshot of the repo {text} (HF_HUB_OFFLINE is "
                f"set, so nothing is downloaded): download it first (hf download {text}) or unset HF_HUB_OFFLINE"
            ) from None
        raise CheckpointError(f"{where} the repo {text} could not be fetched from the Hugging Face Hub and is not "
                              f"in the cache {cache}: {_first_line(e)}") from None
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise CheckpointError(f"{where} the Hugging Face Hub has no repo {text} this machine can read "
                              f"({type(e).__name__}): check the name, or log in for a gated repo") from None
    except (HfHubHTTPError, HFValidationError, OSError) as e:
        raise CheckpointError(f"{where} the Hugging Face repo {text} could not be resolved "
                              f"({type(e).__name__}: {_first_line(e)})") from None
    finally:
        if not progress and not bars_were_off:
            enable_progress_bars()
    return snap


def fetch_weights(fetch: Callable[[list[str]], Path]) -> Path:
    """Download a checkpoint's configs, tokenizer files and one set of weights; return the snapshot directory.

    fetch(patterns) downloads the repo files matching any of the glob patterns into the snapshot and returns it
    (``snapshot_download(..., allow_patterns=patterns)``). Weights as transformers looks for them: the shards
    a ``model.safetensors.index.json`` names, else ``model.safetensors``, else the ``pytorch_model.bin`` shards
    or file. So a repo that also holds other copies (``consolidated.safetensors``, ``.bin`` next to
    safetensors, ``original/``) downloads only the one the loaders read.
    """
    snap = fetch(CONFIG_AND_TOKENIZER)
    for index, single in WEIGHTS:
        if (snap / index).is_file():
            try:
                shards = sorted(set(json.loads((snap / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError, TypeError) as e:
                raise CheckpointError(f"{snap / index} is not a weight index ({type(e).__name__}: {e})") from None
            return fetch(shards)
        snap = fetch([single])
        if (snap / single).is_file():
            return snap
    return snap  # no weights: the loader says so


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
