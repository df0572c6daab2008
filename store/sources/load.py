"""Loading a checkpoint: its device, config, model and tokenizer, and the fingerprint of its weights."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from ncanalyze.core import setting
from ncanalyze.core.errors import CheckpointError, UserError
from ncanalyze.store.sources.discover import Checkpoint, check_safe_weights, layout
from ncanalyze.store.sources.fingerprint import plain_fingerprint
from safetensors import SafetensorError

DTYPES = {name: getattr(torch, name) for name in setting.DTYPES}  # the one list: ncanalyze.analyzer.registry
# what loading a broken checkpoint raises: missing or unreadable files (OSError), malformed JSON or an unknown
# architecture (ValueError, KeyError), a corrupt or truncated safetensors file (SafetensorError), tensors of the
# wrong shape (RuntimeError from load_state_dict)
LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when present, else the CPU (the value checked by setting.device_of, the one parser)."""
    device = setting.device_of(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device (torch.cuda.is_available() is False); use "
                        "--device cpu or auto")
    return dev


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' load report and the Hub client's retry chatter go unprinted: what matters reaches the user as
    one error line of ours (or not at all)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hub = logging.getLogger("huggingface_hub")
    hub_level = hub.level
    hf_logging.set_verbosity_error()
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hub.setLevel(hub_level)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@contextlib.contextmanager
def failing_alone(what: str) -> Iterator[None]:
    """Any error inside, BaseException subclasses too (torch.distributed.checkpoint's CheckpointException), as one
    line ``what: Type: message``, a CheckpointError: that checkpoint fails alone. KeyboardInterrupt, SystemExit and
    GeneratorExit go on, as does a UserError (already one line)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, UserError):
        raise
    except BaseException as e:  # noqa: BLE001 -- peft, torch and DeepSpeed raise any type on a bad file
        raise CheckpointError(f"{what}: {type(e).__name__}: {_first_line(e)}") from None


def load_config(ckpt: Checkpoint, trust_remote_code: bool = False):
    """The checkpoint's model config, read without its weights (an adapter's: its base model's)."""
    from transformers import AutoConfig

    if layout(ckpt.path) == "adapter":
        from ncanalyze.store.sources import adapters

        return load_config(adapters.base_checkpoint(ckpt), trust_remote_code)
    try:
        with quiet_loading():
            return AutoConfig.from_pretrained(str(ckpt.path), trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as e:
        raise CheckpointError(f"cannot read the model config in {ckpt.path}: {_first_line(e)} (custom code needs "
                        "--trust-remote-code)") from None


def load_model(ckpt: Checkpoint, dtype: str, device: torch.device, allow_pickle: bool = False,
               trust_remote_code: bool = False):
    """The causal LM in eval mode on ``device``, in any layout :func:`~discover.layout` names: from safetensors only,
    unless ``allow_pickle``; a PEFT adapter applied to its base model by peft (adapters.py), FSDP's and DeepSpeed's
    shards read by their own libraries (sharded.py, pickles: only with ``allow_pickle``)."""
    kind = layout(ckpt.path)
    if kind == "adapter":
        from ncanalyze.store.sources import adapters

        adapters.require_peft()  # before the base model loads
        folder, name, _ = adapters.base_of(ckpt.path, ckpt.base)
        base = load_model(Checkpoint(folder.name, folder.name, folder, folder), dtype, device, allow_pickle,
                          trust_remote_code)
        with quiet_loading(), failing_alone(f"cannot apply the adapter in {ckpt.path}"):
            return adapters.apply(base, ckpt.path, DTYPES[dtype], allow_pickle, name).to(device)
    if kind in ("fsdp", "zero"):
        from ncanalyze.store.sources import sharded

        read = sharded.fsdp_state_dict if kind == "fsdp" else sharded.zero_state_dict
        with failing_alone(f"cannot read the {kind.upper()} shards in {ckpt.path}"):
            state = read(ckpt.path, allow_pickle)
        return _from_state_dict(ckpt, state, dtype, trust_remote_code).to(device).eval()
    return _load_whole(ckpt, dtype, device, allow_pickle, trust_remote_code)


def _from_state_dict(ckpt: Checkpoint, state: dict[str, torch.Tensor], dtype: str, trust_remote_code: bool):
    """The model of ``ckpt``'s config.json with the weights of ``state`` (a consolidated sharded checkpoint)."""
    from transformers import AutoModelForCausalLM

    config = load_config(ckpt, trust_remote_code)
    with quiet_loading():
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"cannot load the model in {ckpt.path}: {_first_line(e)} (a config.json of another "
                              "model size?)") from None
    tied = {k for k in missing if "lm_head" in k and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        bad = sorted(set(missing) - tied) or sorted(unexpected)
        raise CheckpointError(f"{ckpt.path}: the sharded weights do not match config.json ({len(bad)} tensors "
                              f"{'missing' if set(missing) - tied else 'unexpected'}, e.g. {bad[0]}); they are "
                              "incomplete or from another architecture")
    model.tie_weights()
    return model


def _load_whole(ckpt: Checkpoint, dtype: str, device: torch.device, allow_pickle: bool, trust_remote_code: bool):
    """A model saved whole (``from_pretrained``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bars say what is going on
    safe = check_safe_weights(ckpt.path, allow_pickle)  # nothing but .safetensors is read unless allow_pickle
    try:
        with quiet_loading():
            model, info = AutoModelForCausalLM.from_pretrained(
                str(ckpt.path), dtype=DTYPES[dtype], use_safetensors=safe, trust_remote_code=trust_remote_code,
                output_loading_info=True)
    except LOAD_ERRORS as e:
        if "ignore_mismatched_sizes" in str(e):  # transformers points at a load report that we keep quiet
            raise CheckpointError(f"cannot load the model in {ckpt.path}: the shapes of its weights do not match its "
                                  "config.json (a config of another model size?); put the config the weights were "
                                  "saved with beside them") from None
        raise CheckpointError(f"cannot load the model in {ckpt.path}: {_first_line(e)} (is the weight file complete? "
                        "custom code needs --trust-remote-code)") from None
    missing = [k for k in info.get("missing_keys", []) if "lm_head" not in k or not model.config.tie_word_embeddings]
    if missing:
        raise CheckpointError(f"{ckpt.path}: the weight file lacks {len(missing)} tensors (e.g. {missing[0]}); "
                        "it is incomplete or from another architecture")
    return model.to(device).eval()


def find_tokenizer(ckpt: Checkpoint, name: str | None = None, trust_remote_code: bool = False):
    """(tokenizer, where it came from): ``name`` (--tokenizer), else the checkpoint's, else its run's, else (an
    adapter's) its base model's; (None, None) if there is none."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    places = (ckpt.path, ckpt.run_dir)
    if name is None and layout(ckpt.path) == "adapter":
        from ncanalyze.store.sources import adapters

        places += (adapters.base_of(ckpt.path, ckpt.base)[0],)
    where = name or next((str(p) for p in places if any((p / f).is_file() for f in files)), None)
    if where is None:
        return None, None
    try:
        with quiet_loading():
            return AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code), where
    except LOAD_ERRORS as e:
        raise CheckpointError(f"cannot load tokenizer {where}: {_first_line(e)}; pass --tokenizer with a local "
                        "folder") from None


def decoded_tokens(tokenizer, vocab: int) -> list[str] | None:
    """Each token id's string (empty past the tokenizer's length), or None without a tokenizer."""
    if tokenizer is None:
        return None
    n = min(vocab, len(tokenizer))
    return tokenizer.batch_decode([[i] for i in range(n)]) + [""] * (vocab - n)


def weights_fingerprint(path: Path, base: str | None = None) -> str:
    """Size plus the first and last MiB of each weight file (fingerprint.py): cheap, and different for every
    checkpoint. An adapter's is its own files' with its base model's (``base``: as ``--base`` names it); sharded
    checkpoints' are their shards'."""
    if layout(path) == "adapter":
        from ncanalyze.store.sources import adapters

        return f"{adapters.adapter_fingerprint(path)}+{plain_fingerprint(adapters.base_of(path, base)[0])}"
    return plain_fingerprint(path)
