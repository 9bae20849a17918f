"""The model's building blocks as pure math over a :class:`~clover_lab.model.context.ForwardContext`:
linear and norms, rotary embeddings, gated attention, Gated DeltaNet, the MoE block and its router.
Every op they run goes through ``clover_kernels``."""
