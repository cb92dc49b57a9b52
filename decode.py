#!/usr/bin/env python
"""Generate with a target model: plain, prompt lookup, or EAGLE-3 speculative decoding.

The same command as `python -m eagle3_jax decode` (eagle3_jax/cli/decode.py); `--help` lists
every flag. Every default runs on the embedded SmolLM2-135M-Instruct with its shipped head.
"""

import sys

from eagle3_jax.cli.decode import decode_main, main, parse_args  # noqa: F401 (tests use them)

if __name__ == "__main__":
    sys.exit(main())
