#!/usr/bin/env python
"""Train an EAGLE-3 draft head for a target model: the same command as `python -m eagle3_jax
train` (eagle3_jax/cli/train.py), e.g. `python train.py --config=configs/smollm2_135m.py`."""

import sys

from eagle3_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
