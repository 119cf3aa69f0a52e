"""Training, with optax and orbax: the shared loop (`trainer`), the target's teacher data (`teacher`),
and one job per kind of model: a chain draft distilled from a decoder-only target (`draft_model`),
Medusa heads or an MTP head on its hidden states (`heads`), a T5 on a sequence-to-sequence task
(`seq2seq`, with its objective and steps in `seq2seq_steps`). Run them with `python -m specjax.train`."""
