"""A transformers causal LM's anatomy, in one place: its layers and positions, its blocks and how to cut the forward at
one, its final norm (the logit lens), its head and the logit transform after it. Supporting a new architecture means
touching this module (and ``tests/store/sources/test_anatomy.py``, which runs every supported architecture through it).

The transforms after the head: Cohere's ``logit_scale`` (multiply), Granite's and MiniCPM3's ``logits_scaling``
(divide), Gemma2/3's ``final_logit_softcapping`` (``cap * tanh(logits / cap)``).
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from ncanalyze.core.errors import CheckpointError, UserError

log = logging.getLogger(__name__)

# where models keep their final norm, on the base model
FINAL_NORMS = ("ln_f", "norm", "final_layer_norm", "decoder.final_layer_norm", "final_layernorm", "norm_f")
# models whose ``logits_scaling`` multiplies the logits (MuP), unlike Granite's and MiniCPM3's, which divide
MULTIPLYING_SCALING = {"hyperclovax"}
def n_layers(config) -> int | None:
    """The number of blocks a model config declares, or None."""
    for k in ("num_hidden_layers", "num_layers", "n_layer"):
        if isinstance(getattr(config, k, None), int):
            return getattr(config, k)
    return None


def model_positions(config) -> int | None:
    """The number of positions a model config allows (``max_position_embeddings``, ``n_positions`` or ``n_ctx``), or
    None."""
    for k in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(config, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def default_block_size(config) -> int:
    """The model's context, at most 1024 (``run_clm``'s default)."""
    return min(model_positions(config) or 1024, 1024)


def head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer's weight (vocab x hidden) and bias (None where it has none), detached, as the forward uses
    them: where a PEFT adapter wraps the output layer (LoRA on ``lm_head``), those of a copy of it with the adapter
    merged in by peft (``merge()``), the model itself untouched."""
    out = model.get_output_embeddings()
    if callable(getattr(out, "get_base_layer", None)) and callable(getattr(out, "merge", None)) \
            and not getattr(out, "merged", True):
        out = copy.deepcopy(out)
        out.merge()
        out = out.get_base_layer()
    bias = getattr(out, "bias", None)
    return out.weight.detach(), None if bias is None else bias.detach()


def finite_head(classifier: torch.Tensor, bias: torch.Tensor | None, where: str) -> None:
    """A CheckpointError naming the token ids whose output-layer row (weight or bias) is NaN or infinite: every
    logit would be NaN there, so NC3, NC4, the head's erank and the validation loss would be, whatever the features.

    Parameters
    ----------
    classifier, bias
        The output layer (:func:`head`).
    where
        The checkpoint, for the message.
    """
    bad = ~torch.isfinite(classifier).all(dim=1)
    if bias is not None:
        bad |= ~torch.isfinite(bias)
    if bad.any():
        ids = torch.nonzero(bad).flatten().tolist()
        shown = ", ".join(map(str, ids[:5])) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        raise CheckpointError(f"{where}: the output layer has NaN/Inf weights in the row{'s' * (len(ids) > 1)} of "
                              f"token id{'s' * (len(ids) > 1)} {shown} ({len(ids)} of {len(bad)} rows): the "
                              "checkpoint is damaged or has diverged; extract a sound checkpoint")


def final_norm(model) -> tuple[str, torch.nn.Module] | None:
    """The model's final norm (the logit lens below the last layer).

    Parameters
    ----------
    model : a transformers causal LM.

    Returns
    -------
    (path, module) or None : its path on the base model (one of :data:`FINAL_NORMS`) and the module; None if none
    is known.
    """
    for path in FINAL_NORMS:
        m = model.base_model
        for part in path.split("."):
            m = getattr(m, part, None)
        if isinstance(m, torch.nn.Module):
            return path, m
    return None


@torch.inference_mode()
def features(model, ids: torch.Tensor, end: int | None = -1) -> torch.Tensor:
    """The last layer's features.

    Parameters
    ----------
    model : a transformers causal LM (only its base model runs: no logits are formed).
    ids : token ids, b x L.
    end : the positions kept, ``[:, :end]``: -1 every position but the last (next-token labels), None all.

    Returns
    -------
    Tensor : the last hidden state after the final norm, at every position but the last: (b, L-1, d).
    """
    return model.base_model(input_ids=ids).last_hidden_state[:, :end]


def _where(site) -> tuple[str, int]:
    """(kind, index) of a site: a ``Site`` (store/extraction/sites.py), or an int, the residual site
    ``hidden_states[l]``."""
    return ("resid", int(site)) if isinstance(site, int) else (site.kind, site.index)


def hidden_forward(model, layers: tuple, last, end: int | None = -1) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward pass of a pass's sites. The last layer is ``last_hidden_state``; with only the last layer asked
    (the default plan), no hidden states are formed. The residual sites below it are ``hidden_states[l]``, the
    sublayer sites the outputs of their modules (:func:`sublayer`), taken by forward hooks. A pass without the last
    layer runs the model only up to its deepest site (:func:`cut_forward`), or, where the model cannot be cut, the
    whole forward with a note.

    Parameters
    ----------
    model : a transformers causal LM.
    layers : the pass's sites in forward order: ``Site`` values, or ints (residual sites, hidden_states indices).
    last : the last layer (a residual site).
    end : the positions kept (:func:`features`).

    Returns
    -------
    callable : ids (b x L) -> the sites' features at every position but the last, stacked: (k, b, L-1, d).
    """
    sites, last = [_where(s) for s in layers], _where(last)
    if sites == [last]:
        return lambda ids: features(model, ids, end)[None]
    taps = {s: sublayer(model, *s) for s in sites if s[0] != "resid"}
    hidden = any(s[0] == "resid" and s != last for s in sites)

    @torch.inference_mode()
    def forward(ids: torch.Tensor) -> torch.Tensor:
        got: dict[tuple[str, int], torch.Tensor] = {}
        handles = [m.register_forward_hook(_keep(got, s)) for s, m in taps.items()]
        try:
            out = model.base_model(input_ids=ids, output_hidden_states=hidden or None)
        finally:
            for handle in handles:
                handle.remove()
        got[last] = out.last_hidden_state
        return torch.stack([(got[s] if s in got else out.hidden_states[s[1]])[:, :end] for s in sites])
    if last in sites:
        return forward
    return cut_forward(model, layers, forward, end) or forward


def _keep(got: dict, site: tuple[str, int], stop: bool = False):
    """A forward hook keeping a copy of a sublayer's output (its first element, where it returns a tuple) under
    ``site`` (a copy: Falcon's block adds the attention output into the MLP's in place); with ``stop``, the forward
    ends there."""
    def hook(module, args, output):
        got[site] = (output[0] if isinstance(output, tuple) else output).clone()
        if stop:
            raise _Cut
    return hook


# where models keep their blocks, on the base model (GPT-2/GPT-Neo/Falcon/BLOOM, Llama/Mistral/Gemma/Qwen/OLMo/
# GPT-NeoX, OPT, MPT)
BLOCKS = ("h", "layers", "decoder.layers", "blocks")
# a block's attention and MLP sublayers, by the names models give them (GPT-2/GPT-Neo/MPT, Llama and most,
# GPT-NeoX, Falcon; MPT's ffn): their output is the sublayer's, before the block adds it to the residual stream
SUBLAYERS = {"attn": ("attn", "self_attn", "attention", "self_attention"), "mlp": ("mlp", "ffn", "feed_forward")}
# models whose sublayers add the residual inside themselves (BLOOM): no output before the add to hook
INNER_RESIDUAL = {"bloom"}


class _Cut(Exception):
    """Raised at the deepest site, before its block (a residual site) or after its sublayer: the forward stops."""


def blocks_of(model) -> torch.nn.ModuleList | None:
    """The model's blocks: the list whose block j takes ``hidden_states[j]`` as its input.

    Parameters
    ----------
    model : a transformers causal LM.

    Returns
    -------
    ModuleList or None : the first of :data:`BLOCKS` on the base model with as many blocks as the config's layers;
    None where none is.
    """
    n = n_layers(model.config)
    for path in BLOCKS:
        m = model.base_model
        for part in path.split("."):
            m = getattr(m, part, None)
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    return None


def sublayer(model, kind: str, block: int) -> torch.nn.Module | None:
    """Block ``block``'s ``kind`` sublayer (``attn`` or ``mlp``): the first of its :data:`SUBLAYERS` names on the
    block; None where the model has none (OPT's MLP is not a module; BLOOM's sublayers add the residual inside)."""
    blocks = blocks_of(model)
    if blocks is None or model.config.model_type in INNER_RESIDUAL or not 0 <= block < len(blocks):
        return None
    return next((m for name in SUBLAYERS[kind] if isinstance(m := getattr(blocks[block], name, None),
                                                               torch.nn.Module)), None)


def check_sites(model, sites) -> None:
    """A UserError naming the first sublayer site the model lacks (:func:`sublayer`)."""
    for site in sites:
        kind, index = _where(site)
        if kind != "resid" and sublayer(model, kind, index) is None:
            raise UserError(f"--sites {kind}:{index}: {model.config.model_type} has no {kind} sublayer whose output "
                            f"comes before its residual add (looked for {', '.join(SUBLAYERS[kind])} on its blocks); "
                            "drop that site (resid sites work on every model)")


def cut_forward(model, layers: tuple, full: Callable[[torch.Tensor], torch.Tensor], end: int | None = -1
                ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The features of ``layers`` (sites, none of them the last layer) from a forward that stops at the deepest: each
    ``hidden_states[l]`` is taken as block l's input by a forward pre-hook, each sublayer's output by a forward hook,
    and the deepest site's hook ends the forward (no later block, final norm or head runs). On its first call the cut
    is checked bit for bit against ``full`` on a prefix of the batch; where it differs (or the model's blocks are not
    found) the pass runs ``full`` with a note.

    Parameters
    ----------
    model : a transformers causal LM.
    layers : the pass's sites in forward order (as :func:`hidden_forward`), none the last layer.
    full : the whole forward, as :func:`hidden_forward` makes it.
    end : the positions kept (:func:`features`).

    Returns
    -------
    callable or None : ids (b x L) -> (k, b, L-1, d); None where the model's blocks are not found (with a note).
    """
    blocks = blocks_of(model)
    if blocks is None:
        log.info("note: %s's blocks are not found (none of %s): the passes below the last layer run the whole "
                 "forward", model.config.model_type, ", ".join(BLOCKS))
        return None
    sites = [_where(s) for s in layers]
    deepest = sites[-1]

    @torch.inference_mode()
    def cut(ids: torch.Tensor) -> torch.Tensor:
        got: dict[tuple[str, int], torch.Tensor] = {}

        def take(site: tuple[str, int]):
            def hook(module, args, kwargs):
                got[site] = args[0] if args else kwargs["hidden_states"]
                if site == deepest:
                    raise _Cut
            return hook
        handles = [blocks[s[1]].register_forward_pre_hook(take(s), with_kwargs=True) if s[0] == "resid" else
                   sublayer(model, *s).register_forward_hook(_keep(got, s, stop=s == deepest)) for s in sites]
        try:
            model.base_model(input_ids=ids)
        except _Cut:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return torch.stack([got[s][:, :end] for s in sites])

    checked: list[Callable[[torch.Tensor], torch.Tensor]] = []

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if not checked:
            prefix = ids[:1, :64]
            try:
                same = torch.equal(cut(prefix), full(prefix))
            except (KeyError, IndexError, RuntimeError, TypeError):
                same = False
            checked.append(cut if same else full)
            if not same:
                log.info("note: %s cannot be cut at its blocks' inputs (they are not its hidden states): the passes "
                         "below the last layer run the whole forward", model.config.model_type)
        return checked[0](ids)
    return forward


@dataclass(frozen=True)
class LogitTransform:
    """``logits * multiply / divide``, then soft-capped at ``softcap`` when set: what the model does after its head."""
    multiply: float = 1.0
    divide: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> LogitTransform:
        """The transform a model config declares (its text config, for multimodal configs)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config

        def number(name: str) -> float | None:
            v = getattr(text, name, None)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        scaling = number("logits_scaling") or 1.0
        if getattr(text, "model_type", None) in MULTIPLYING_SCALING:
            return cls(multiply=scaling * (number("logit_scale") or 1.0),
                       softcap=number("final_logit_softcapping") or None)
        return cls(multiply=number("logit_scale") or 1.0, divide=scaling,
                   softcap=number("final_logit_softcapping") or None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def describe(self) -> str:
        """How the logits were transformed, e.g. ``'30.0 * tanh(logits * 0.0625 / 30.0)'``; ``'none'``."""
        s = "logits" + (f" * {self.multiply!r}" if self.multiply != 1.0 else "") + \
            (f" / {self.divide!r}" if self.divide != 1.0 else "")
        if self.softcap is not None:
            s = f"{self.softcap!r} * tanh({s} / {self.softcap!r})"
        return "none" if s == "logits" else s
