"""A scheduled batch through a model: the model runner (``model_runner``), the emulated
runner that charges the cost model's time instead (``emulated_runner``), a tensor-parallel
engine's other ranks (``tp_ranks``), and the warm-up that compiles the kernels before the
first request (``warm_up``). Imports ``scheduling`` for the batch."""
