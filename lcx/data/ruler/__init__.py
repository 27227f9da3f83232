"""RULER's synthetic suite, generated offline in any tokenizer's tokens.

RULER (Hsieh et al., NVIDIA 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
github.com/NVIDIA/RULER) measures long-context models with 13 tasks; this module has its 11 synthetic ones (the two
QA tasks need SQuAD / HotpotQA), registered under RULER's names with the settings of RULER's ``synthetic.yaml`` as
field defaults, RULER's instruction / question / answer-prefix texts (``scripts/data/synthetic/constants.py``), and
RULER's metric ``string_match_all`` (the share of references found in the output, case-insensitive) as ``score``:

- ``niah_single_1`` / ``_2`` / ``_3``: one needle "One of the special magic numbers for {key} is: {value}." in the
  noise haystack (word key, 7-digit value), in prose (word key, number), in prose (word key, UUID value);
- ``niah_multikey_1``: prose with 4 needles, 1 queried and 3 distractors; ``niah_multikey_2``: the haystack is
  made of distractor needles (word keys, numbers); ``niah_multikey_3``: the same with UUID keys and UUID values;
- ``niah_multivalue``: 4 values for one key, all asked; ``niah_multiquery``: 4 keys, all asked;
- ``vt`` (variable tracking): one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of 4 hops hidden among noise
  lines, after a one-shot example (RULER's in-context example of about 500 tokens); answer: the chain's 5 names;
- ``cwe`` (common words extraction): a numbered list "1. w 2. w ..." in which 10 words occur 30 times and the others
  3 times (below 4096 tokens RULER's short setting: 6 times and once), after a one-shot example; answer: the 10;
- ``fwe`` (frequent words extraction): coded words (6 random letters) with counts from a zeta distribution
  (alpha 2.0), the most frequent one replaced by "..." as noise; answer: the 3 next most frequent.

Every example is at most ``seq_len + 1`` tokens: the prompt (framed plainly or in a chat template by
``haystack.Frame``, with the answer prefix after the question or opening the reply), the answer tokens and EOS
(``loss_mask`` on the answer and EOS). The NIAH tasks fit exactly: the instruction, needles, question, prefix and
answer are pieces of known length and the haystack (``haystack.Haystack.take``) gets the rest. ``vt``, ``cwe`` and
``fwe`` search, like RULER, for the largest number of noise lines / listed words / coded words whose example fits,
so that one more would not.

Differences from RULER:

- Offline word lists instead of ``wonderwords``: ``words()`` are the alphabetic words of the Python reference manual
  (``haystack.prose_text()``; 3-10 letters, lower-cased, with a vowel, deduplicated and sorted, ~2.5k words, which
  depend on the Python version like the prose itself). NIAH keys and word values are two of them joined by "-"
  (RULER: adjective-noun); ``cwe`` lists them, then hyphenated pairs once a list needs more words than there are
  (RULER then switches to a larger English word list).
- The prose haystack (``haystack.prose_text()``, from a random sentence start) replaces Paul Graham's essays; the
  noise haystack runs on as one text ("... back again. The grass ...") with needles between its sentences, where
  RULER puts noise repetitions and needles on lines of their own. Needles never open the haystack or close it
  (RULER's depth 0 / 100): they go after its first sentence and before its last, possibly cut, one.
- The ``needle`` haystack fits exactly: it opens with the end of one more distractor line (as a window cut from a
  longer list would) to use up the tokens a whole line would overflow.
- Distractor keys differ from the queried keys, values of one example differ, and chains get distinct values (RULER
  draws them independently and may repeat one).
- The example holds the reference answer, not RULER's generation budget (``tokens_to_generate``, kept here as
  ``max_new_tokens`` for an evaluation to use); one-shot examples are plain text at the start of the user message
  (RULER formats ``cwe``'s with the model's chat template too).

Layout: ``base`` (the suite, the metric, word lists, ``RulerTask``), ``niah`` (retrieval), ``tracing`` (``vt``),
``aggregation`` (``cwe``, ``fwe``); importing this package registers every task.
"""

from lcx.data.ruler.aggregation import (CWE_INSTRUCTION, FWE_INSTRUCTION, CommonWordsExtraction,
                                        FrequentWordsExtraction, zeta)
from lcx.data.ruler.base import RULER_SUITE, RulerTask, macro_average, string_match_all, words
from lcx.data.ruler.niah import NIAH_INSTRUCTION, NIAH_NEEDLE, Niah, niah_texts
from lcx.data.ruler.tracing import VT_INSTRUCTION, VariableTracking

__all__ = ["CWE_INSTRUCTION", "FWE_INSTRUCTION", "NIAH_INSTRUCTION", "NIAH_NEEDLE", "RULER_SUITE", "VT_INSTRUCTION",
           "CommonWordsExtraction", "FrequentWordsExtraction", "Niah", "RulerTask", "VariableTracking",
           "macro_average", "niah_texts", "string_match_all", "words", "zeta"]
