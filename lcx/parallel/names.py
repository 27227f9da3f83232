"""Names config modules validate against, kept apart from the code that implements them (a config check imports
no implementation)."""

STRATEGIES = ("ring", "all_gather")  # context-parallel attention strategies (``lcx.parallel.context``)
