"""Built-in data, all offline: tokenizers, synthetic long-context tasks, a text corpus, your own documents, batches.

Importing this package registers the built-in tasks (``tasks.py``, ``corpus.py``, ``mixture.py``, ``documents.py``,
``prose.py``) in the registry of ``task.py``.
"""

from lcx.data import corpus, documents, mixture, prose, ruler, tasks  # noqa: F401  (register the built-in tasks)
from lcx.data.batches import BatchSource, pack
from lcx.data.corpus import Corpus
from lcx.data.task import Example, Task, make_task, register, task_names
from lcx.data.tokenizer import ByteTokenizer, HFTokenizer, resolve_tokenizer

__all__ = ["BatchSource", "ByteTokenizer", "Corpus", "Example", "HFTokenizer", "Task", "make_task", "pack",
           "register", "resolve_tokenizer", "task_names"]
