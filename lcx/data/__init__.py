"""Built-in data, all offline: the byte-level tokenizer, synthetic long-context tasks, a text corpus, batches.

Importing this package registers the built-in tasks (``tasks.py``, ``corpus.py``) in the registry of ``task.py``.
"""

from lcx.data import corpus, mixture, tasks  # noqa: F401  (register the built-in tasks)
from lcx.data.batches import BatchSource, pack
from lcx.data.corpus import Corpus
from lcx.data.task import Example, Task, make_task, register, task_names
from lcx.data.tokenizer import ByteTokenizer

__all__ = ["BatchSource", "ByteTokenizer", "Corpus", "Example", "Task", "make_task", "pack", "register",
           "task_names"]
