"""A scheduled batch through a model: the model runner (``model_runner``), the emulated
runner that charges the cost model's time instead (``emulated_runner``), and a
tensor-parallel engine's other ranks (``tp_ranks``). Imports ``scheduling`` for the batch."""
