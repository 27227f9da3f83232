"""Built-in data, all offline: the byte-level tokenizer, synthetic long-context tasks, a text corpus, batches."""

from lcx.data.batches import BatchSource, pack
from lcx.data.corpus import Corpus
from lcx.data.tasks import Example, Task, make_task, task_names
from lcx.data.tokenizer import ByteTokenizer

__all__ = ["BatchSource", "ByteTokenizer", "Corpus", "Example", "Task", "make_task", "pack", "task_names"]
