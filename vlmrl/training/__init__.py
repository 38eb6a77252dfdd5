"""The Megatron trainer: parallel state, packing, train step, optimizer, checkpoint.

Import-light: submodules import torch and megatron-core themselves.
"""
