"""Drafters: what proposes the candidates the target verifies (contracts.Drafter).

  registry   drafters by name: the spec parsed from the user's string, the kinds, `build`
  expansion  one-token steps as drafters (a sampled chain, a top-k tree); ranked candidates per depth
  model      a model draft of either family, from a checkpoint or the target's first layers
  tables     unigram and sparse bigram tables
  lookup     prompt lookup, alone or in front of any drafter
  heads      Medusa heads on the target's hidden state (trained by specjax.training.heads)
  mtp        a shared MTP head applied recursively on it
  dflash     a block drafter reading several of the target's layers (trained by training.dflash)
  eagle3     EAGLE-3: one layer over three of them, growing a dynamic tree (training.eagle3)
"""
