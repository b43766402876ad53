"""Parallelism applied from outside the model: the mesh, and one recipe (`parallelize`) whose
slots apply FP8, tensor/sequence, expert and data parallelism to a single-device model."""

from hyperloom.parallel.layout import ParallelModel
from hyperloom.parallel.mesh import ParallelMesh, build_mesh, init_distributed
from hyperloom.parallel.parallelize import build_parallel_model, parallelize

__all__ = [
    "ParallelMesh",
    "ParallelModel",
    "build_mesh",
    "build_parallel_model",
    "init_distributed",
    "parallelize",
]
