"""What the engine's programs cost and hold on a TPU or a GPU, worked out on a CPU-only machine.

Two tools over the same published devices and models (`specs`):

  a cost model, counted from the shapes, no device work:
    roofline    bytes moved and FLOPs per phase of a plain decode step and a speculative round,
                and their roofline time on a device
    acceptance  τ of a tree shape from a positional model of the draft's ranking, calibrated on
                measured τ
    predict     speedups per device, target and tree; the best tree of a grid; the CPU check
    hbm         what stays in HBM: resident bytes and the chips that hold them, and the
                activations of the exported programs
  the real programs, lowered for TPUs and GPUs (`jax.export`, nothing compiled or allocated):
    programs    every jitted program with abstract, sharded arguments at real sizes
    lowering    exporting one, what a TPU or GPU would object to in it (`Report`), and its bytes
                per device (`Memory`)

docs/cost_model.md has the cost model's predictions; benchmarks/cost_model.py and
benchmarks/accelerator_export.py run both over the published targets.
"""
