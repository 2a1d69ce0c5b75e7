"""The user's and the tasks' prompt data: read files, map rows, render chat, tokenise, order.

``readers`` (JSONL / JSON / parquet / ``datasets`` folders → rows), ``mapping`` (dotted paths →
prompt and reward fields), ``chat`` (chat template), ``prompts`` (rows → ``PromptItem`` s under
the length rules; the run's data checks), ``stream`` (the seeded epoch order). It imports only
``api`` and ``config``; tasks generate rows and hand them here.
"""

from sluice.data.prompts import PromptBuilder, PromptLimit, PromptSet, check_user_data, prompt_limit
from sluice.data.readers import DatasetError, RowSet, in_memory, read_jsonl, read_rows
from sluice.data.stream import PromptStream

__all__ = [
    "DatasetError",
    "PromptBuilder",
    "PromptLimit",
    "PromptSet",
    "PromptStream",
    "RowSet",
    "check_user_data",
    "in_memory",
    "prompt_limit",
    "read_jsonl",
    "read_rows",
]
