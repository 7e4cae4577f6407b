"""Make the served model's tokenizer loadable by clients that take a Hugging Face repository name
(NVIDIA's aiperf, guidellm) on a machine without the Hub: the tokenizer (from the GGUF's metadata)
is written as a snapshot of a local repository in the Hugging Face cache (``$HF_HOME/hub``), so that
``--tokenizer tidal/<name>`` loads it with ``HF_HUB_OFFLINE=1``. Prints the repository name and an
aiperf command. Usage::

    python benchmarks/aiperf_tokenizer.py [--model PATH] [--repo tidal/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import sys

REVISION = "0" * 40  # the snapshot's name: any commit-shaped id, pointed to by refs/main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: tidal's default model)")
    p.add_argument("--repo", default="tidal/smollm2-135m-instruct", help="the repository name clients will use")
    args = p.parse_args()
    from huggingface_hub.constants import HF_HUB_CACHE

    from tidal.engine.loader import load_checkpoint
    from tidal.engine.tokenizer import Tokenizer

    ckpt = load_checkpoint(args.model)
    tok = Tokenizer.from_checkpoint(ckpt)
    root = os.path.join(HF_HUB_CACHE, "models--" + args.repo.replace("/", "--"))
    snap = os.path.join(root, "snapshots", REVISION)
    tok.hf.save_pretrained(snap)
    with open(os.path.join(snap, "config.json"), "w") as f:  # some loaders look for it before the tokenizer
        f.write('{"model_type": "%s"}\n' % (ckpt.arch.architecture or "llama"))
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(REVISION)
    print(f"wrote {snap}")
    print(f"HF_HUB_OFFLINE=1 aiperf profile --model {ckpt.arch.name or 'MODEL'} --url http://127.0.0.1:8000 "
          f"--endpoint-type completions --streaming --tokenizer {args.repo} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
