"""Benchmarks (`make bench`): results land in bench/results/ with the command that made them."""
