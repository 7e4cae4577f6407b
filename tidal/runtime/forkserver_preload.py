"""Imported by the forkserver that local workers are forked from
(:class:`tidal.runtime.backend.ProcessBackend`), and by nothing else: torch, the engine, the
worker loop and the tokenizer's transformers classes are imported once there, so a worker (or a
restarted one) starts without importing them anew. Importing it starts no thread and touches no
device (CUDA is initialised in each worker, after the fork).

It also ties the forkserver's life to the front end's (Linux ``PR_SET_PDEATHSIG``): when the front
end dies, even by SIGKILL, the forkserver dies, and with it every worker (each tied to its own
parent, the forkserver, the same way), so none is orphaned.
"""

from __future__ import annotations

import torch  # noqa: F401
import zmq  # noqa: F401
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

import tidal.engine.llm_engine  # noqa: F401
from tidal.runtime.worker import die_with_parent

die_with_parent()
