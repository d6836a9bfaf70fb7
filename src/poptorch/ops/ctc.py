"""``ctc_beam_search_decoder``: CTC prefix beam search written with torch tensors."""
from __future__ import annotations

import math

import torch

from ..errors import Error

__all__ = ["ctc_beam_search_decoder"]

_NEG_INF = float("-inf")


def _logaddexp(a: float, b: float) -> float:
    if a == _NEG_INF:
        return b
    if b == _NEG_INF:
        return a
    high, low = (a, b) if a > b else (b, a)
    return high + math.log1p(math.exp(low - high))


def _decode_one(log_probs: list[list[float]], blank: int,
                beam_width: int) -> list[tuple[tuple[int, ...], float]]:
    """Prefix beam search over one sequence: [(labels, log probability)], best first."""
    # prefix -> [log P(prefix, ending in blank), log P(prefix, ending in a label)]
    beams: dict[tuple[int, ...], list[float]] = {(): [0.0, _NEG_INF]}
    for step in log_probs:
        grown: dict[tuple[int, ...], list[float]] = {}

        def entry(prefix: tuple[int, ...],
                  grown: dict[tuple[int, ...], list[float]] = grown) -> list[float]:
            """The scores of ``prefix`` in this step's beams."""
            return grown.setdefault(prefix, [_NEG_INF, _NEG_INF])

        for prefix, (p_blank, p_label) in beams.items():
            p_total = _logaddexp(p_blank, p_label)
            stay = entry(prefix)
            stay[0] = _logaddexp(stay[0], p_total + step[blank])
            for label, p in enumerate(step):
                if label == blank or p == _NEG_INF:
                    continue
                extended = entry((*prefix, label))
                if prefix and prefix[-1] == label:
                    # A repeat only starts a new label after a blank; otherwise it merges.
                    extended[1] = _logaddexp(extended[1], p_blank + p)
                    stay[1] = _logaddexp(stay[1], p_label + p)
                else:
                    extended[1] = _logaddexp(extended[1], p_total + p)
        ranked = sorted(grown.items(), key=lambda kv: (-_logaddexp(*kv[1]), kv[0]))
        beams = dict(ranked[:beam_width])
    final = [(prefix, _logaddexp(*scores)) for prefix, scores in beams.items()]
    return sorted(final, key=lambda item: (-item[1], item[0]))


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0,
                            beam_width: int = 100, top_paths: int = 1
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode CTC outputs with a prefix beam search.

    Args:
        probs: log probabilities, shape ``[input_length, batch_size, num_classes]``.
        lengths: the number of valid time steps of each sequence, shape ``[batch_size]``.
        blank: the blank class.
        beam_width: prefixes kept after each time step.
        top_paths: number of most likely label sequences to return.

    Returns:
        ``(path_probs, path_lengths, paths)``: the log probability of each path
        (``[batch_size, top_paths]``, dtype of ``probs``; the sum over all alignments
        that collapse to the path), the number of labels in each path
        (``[batch_size, top_paths]``, int64) and the paths themselves
        (``[batch_size, top_paths, input_length]``, int64, padded after the path's
        length with ``blank``). When fewer than ``top_paths`` distinct paths exist the
        missing ones have log probability ``-inf`` and length 0.
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 3:
        raise Error("ctc_beam_search_decoder: probs must be a tensor of shape "
                    "[input_length, batch_size, num_classes].")
    steps, batch, classes = probs.shape
    lengths = torch.as_tensor(lengths)
    if lengths.shape != (batch,) or lengths.is_floating_point():
        raise Error(f"ctc_beam_search_decoder: lengths must be an integer tensor of shape "
                    f"[{batch}] (one length per sequence), got shape {tuple(lengths.shape)}.")
    if bool((lengths < 0).any()) or bool((lengths > steps).any()):
        raise Error(f"ctc_beam_search_decoder: lengths must be within [0, {steps}].")
    for name, value, low in (("blank", blank, 0), ("beam_width", beam_width, 1),
                             ("top_paths", top_paths, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise Error(f"ctc_beam_search_decoder: {name} must be an int >= {low}, "
                        f"got {value!r}.")
    if blank >= classes:
        raise Error(f"ctc_beam_search_decoder: blank={blank} is not a class index "
                    f"(num_classes={classes}).")
    if top_paths > beam_width:
        raise Error(f"ctc_beam_search_decoder: top_paths ({top_paths}) cannot exceed "
                    f"beam_width ({beam_width}).")
    host = probs.detach().double().cpu()
    path_probs = torch.full((batch, top_paths), _NEG_INF, dtype=torch.float64)
    path_lengths = torch.zeros((batch, top_paths), dtype=torch.long)
    paths = torch.full((batch, top_paths, steps), blank, dtype=torch.long)
    for b in range(batch):
        decoded = _decode_one(host[:int(lengths[b]), b].tolist(), blank, beam_width)
        for rank, (labels, score) in enumerate(decoded[:top_paths]):
            path_probs[b, rank] = score
            path_lengths[b, rank] = len(labels)
            paths[b, rank, :len(labels)] = torch.tensor(labels, dtype=torch.long)
    device = probs.device
    return (path_probs.to(probs.dtype).to(device), path_lengths.to(device), paths.to(device))
