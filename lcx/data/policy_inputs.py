"""What some cache policies need from the tokenizer before they can run, built in a task's frame.

- KVzip's repeat prompt (``Generator(reconstruction=)``): the frame's ``Reconstruction`` (``Frame.reconstruction``).
- DuoAttention's calibration text (``Generator(calibration=)``): passkey prompts with their answers, in the frame's
  tokens (the paper calibrates on synthetic passkey retrieval) - the heads whose answer queries reach back past the
  streaming window to the key are the retrieval heads (``lcx.cache.duo``). The prompts come from the training split,
  never an evaluation's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lcx.data.haystack import Frame
from lcx.data.task import make_task

CALIBRATION_DEPTHS = (0.25, 0.5, 0.75)


def calibration_ids(frame: Frame, length: int = 2048) -> np.ndarray:
    """``[3, ~length]`` passkey prompts with their answers (training split; key at depths 0.25 / 0.5 / 0.75) in
    ``frame``'s tokenizer and chat framing, cut on the left to one length (the scored queries are each row's
    last ones - the question and the answer; see ``lcx.cache.duo.head_scores``)."""
    chat = frame.chat is not None
    tasks = [dataclasses.replace(make_task("passkey", {"depth": d}).with_tokenizer(frame.tokenizer, chat=chat),
                                 bos_first=frame.bos_first) for d in CALIBRATION_DEPTHS]
    rows = [task.examples(0, 0, 1, length, "train")[0].ids for task in tasks]
    width = min(len(r) for r in rows)
    return np.stack([r[len(r) - width:] for r in rows]).astype(np.int32)


def policy_inputs(policy, frame: Frame) -> dict:
    """The ``Generator`` arguments ``policy`` needs in ``frame``'s tokens: ``reconstruction`` (a policy that
    ``reconstructs``), ``calibration`` (one that ``calibrates`` and is not yet ``calibrated``); none otherwise."""
    out = {}
    if getattr(policy, "reconstructs", False):
        out["reconstruction"] = frame.reconstruction()
    if getattr(policy, "calibrates", False) and not policy.calibrated:
        out["calibration"] = calibration_ids(frame)
    return out


__all__ = ["CALIBRATION_DEPTHS", "calibration_ids", "policy_inputs"]
