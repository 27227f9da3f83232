"""The mixture task and the passkey variants the quickstart's training recipe uses."""

from __future__ import annotations

import numpy as np
import pytest

from lcx.config import ConfigError
from lcx.data import BatchSource, make_task
from lcx.data.task import TOKENIZER
from lcx.data.tasks import NOISE, PASSKEY_TEMPLATES

PARTS = [{"task": "corpus", "weight": 0.25, "loss_weight": 0.2},
         {"task": "passkey", "weight": 0.75, "params": {"instruction": False, "template": "compact",
                                                        "filler_min": 0, "offset": True}}]


def test_mixture_draws_parts_by_weight_deterministically():
    task = make_task("mixture", {"parts": PARTS})
    a = task.examples(3, 5, 64, 128)
    b = task.examples(3, 5, 64, 128)
    assert [x.ids.tolist() for x in a] == [x.ids.tolist() for x in b]  # a pure function of (seed, index)
    corpus = [ex for ex in a if not ex.answer]
    assert 8 <= len(corpus) <= 28  # about a quarter of 64
    assert {ex.weight for ex in corpus} == {0.2} and {ex.weight for ex in a if ex.answer} == {1.0}
    assert a[0].ids.tolist() != task.examples(3, 6, 64, 128)[0].ids.tolist() or \
        a[1].ids.tolist() != task.examples(3, 6, 64, 128)[1].ids.tolist()


def test_mixture_loss_weight_reaches_the_batch_weights():
    batch = BatchSource(make_task("mixture", {"parts": PARTS}), seq_len=128, batch_size=16, seed=0)(0)
    weights = np.unique(batch["weights"][batch["answer"] > 0])
    np.testing.assert_allclose(weights, [0.2, 1.0], rtol=1e-6)  # corpus tokens at their loss weight, answers at 1


@pytest.mark.parametrize("parts, message", [
    ([], "a mixture needs at least one"),
    ([{"task": "passkey", "weight": 0}], "parts[0].weight=0 is invalid"),
    ([{"task": "passkey", "weigth": 1}], "parts[0].weigth is not a key of a mixture part"),
    ([{"task": "mixture"}], "mixtures do not nest"),
    ([{"task": "passkey", "params": {"depht": 0.5}}], "unknown key 'data.params.parts[0].params.depht'"),
])
def test_mixture_bad_parts_name_the_key(parts, message):
    with pytest.raises(ConfigError) as err:
        make_task("mixture", {"parts": parts})
    assert message in str(err.value)


def test_passkey_offset_starts_mid_sentence_and_compact_template():
    task = make_task("passkey", {"instruction": False, "template": "compact", "offset": True, "depth": 1.0,
                                 "filler_tokens": 60})
    starts = set()
    for ex in task.examples(0, 0, 20, 128):
        text = TOKENIZER.decode(ex.prompt_ids)
        needle, question, prefix = PASSKEY_TEMPLATES["compact"]  # compact: no question, the answer prefix only
        assert question == "" and text.endswith("\n" + prefix) and needle.format(key=ex.answer) in text
        starts.add(text[:20])
        assert text[:20] in (NOISE * 3)  # a piece of the haystack, from anywhere in it
    assert len(starts) > 5
    with pytest.raises(ConfigError, match="data.params.template='short' is invalid"):
        make_task("passkey", {"template": "short"})
