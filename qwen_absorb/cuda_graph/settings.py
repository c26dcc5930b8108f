"""The tunables of CUDA-graph mode, in one place: every module of the package reads them as ``settings.NAME`` at
call time, so that the CPU tests can drive the capture logic with fake CUDA-graph objects by monkeypatching this
module alone."""

# The prefix of every reason counted in the ``fallbacks`` counter.
PREFIX = "cuda_graph: "
# Alignment (bytes) the signature distinguishes up to, and modulo which static buffers copy an input's
# address. The CUDA caching allocator hands out 512-byte aligned blocks.
ALIGN = 256
# Invalidations of graphs that were never replayed, in a row, before the runner stops capturing: a model
# whose state changes on every call would otherwise capture on every call.
MAX_UNREPLAYED_INVALIDATIONS = 3
# Device types graphs are captured on (inputs and the model's tensors must be on one of them).
GRAPH_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# Signatures whose eager calls are counted for ``capture_after`` (least recently seen forgotten first).
MAX_COUNTED_SIGNATURES = 64
