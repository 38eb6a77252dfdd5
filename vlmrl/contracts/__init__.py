"""What vlmrl knows of each SGLang release it speaks, read from that release's source: the
ServerArgs flag list (`sglang_flags`) and the HTTP contract (`sglang_contract`), with one pair
of generated files per release in this directory (`sglang-<version>.flags.txt`,
`sglang-<version>.json`). Standard library only and no vlmrl imports, so that the config's
validation and the rollout side both read it: it sits below both."""
