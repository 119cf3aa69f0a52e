"""The papers' published figures that experiments.tables and experiments.plots print beside ours
(REFERENCE.md section 2), and which of our prompt sets stands in for which paper task."""

# Keyed by the table they come from.
PAPER = {
    "leviathan_table2": {
        "paper": "Leviathan et al. 2022", "table": "Tables 2 and 4",
        "setup": "T5-XXL 11B target, T5 v1.1 drafts, batch 1, one TPU-v4",
        # (task, draft, temperature, gamma, alpha, expected speedup, measured speedup)
        "rows": [
            ("EnDe", "T5-small", 0, 7, 0.75, 3.2, 3.4), ("EnDe", "T5-base", 0, 7, 0.80, 3.3, 2.8),
            ("EnDe", "T5-large", 0, 7, 0.82, 2.5, 1.7), ("EnDe", "T5-small", 1, 7, 0.62, 2.3, 2.6),
            ("EnDe", "T5-base", 1, 5, 0.68, 2.4, 2.4), ("EnDe", "T5-large", 1, 3, 0.71, 2.0, 1.4),
            ("CNNDM", "T5-small", 0, 5, 0.65, 2.4, 3.1), ("CNNDM", "T5-base", 0, 5, 0.73, 2.6, 3.0),
            ("CNNDM", "T5-large", 0, 3, 0.74, 2.0, 2.2), ("CNNDM", "T5-small", 1, 5, 0.53, 1.9, 2.3),
            ("CNNDM", "T5-base", 1, 3, 0.55, 1.8, 2.2), ("CNNDM", "T5-large", 1, 3, 0.56, 1.6, 1.7),
        ],
    },
    "leviathan_table3": {
        "paper": "Leviathan et al. 2022", "table": "Table 3",
        # (target, task) -> [(draft kind, draft, alpha at temperature 0, alpha at temperature 1)]
        "rows": {
            ("GPT-like 97M", "lm1b"): [("model", "6M", 0.88, 0.89), ("unigram", "unigram", 0.03, None),
                                       ("bigram", "bigram", 0.05, None)],
            ("T5-XXL", "EnDe"): [("unigram", "unigram", 0.08, 0.07), ("bigram", "bigram", 0.20, 0.19),
                                 ("model", "T5-small", 0.75, 0.62), ("model", "T5-base", 0.80, 0.68),
                                 ("model", "T5-large", 0.82, 0.71)],
            ("T5-XXL", "CNNDM"): [("unigram", "unigram", 0.13, 0.08), ("bigram", "bigram", 0.23, 0.16),
                                  ("model", "T5-small", 0.65, 0.53), ("model", "T5-base", 0.73, 0.55),
                                  ("model", "T5-large", 0.74, 0.56)],
            ("LaMDA 137B", "dialog"): [("model", "100M", 0.61, 0.57), ("model", "2B", 0.71, 0.71),
                                       ("model", "8B", 0.75, 0.74)],
        },
    },
    "leviathan_table5": {
        "paper": "Leviathan et al. 2022", "table": "Table 5 (app. A.5)",
        "setup": "T5-XXL EnDe; argmax speedups at c = 0.015, gamma = 8",
        # (draft kind, draft, temperature) -> (alpha, speedup or None) at lenience 1, 0.5, 0.3, 0.1
        "lenience": (1.0, 0.5, 0.3, 0.1),
        "rows": {("unigram", "unigram", 1): ((0.07, 0.10, 0.11, 0.16), None),
                 ("bigram", "bigram", 1): ((0.19, 0.23, 0.25, 0.32), None),
                 ("model", "T5-small", 1): ((0.62, 0.71, 0.76, 0.84), None),
                 ("model", "T5-base", 1): ((0.68, 0.80, 0.83, 0.90), None),
                 ("model", "T5-small", 0): ((0.75, 0.75, 0.80, 0.87), (3.3, 3.3, 3.9, 4.9))},
    },
    "chen_table1": {
        "paper": "Chen et al. 2023", "table": "Table 1",
        "setup": "Chinchilla 70B target, 4B draft, 16 TPU v4, batch 1, K = 4",
        # (method, task, greedy, baseline ms/token, speculative ms/token, speedup)
        "rows": [("nucleus p=0.8", "XSum", False, 14.1, 7.52, 1.92),
                 ("greedy", "XSum", True, 14.1, 7.00, 2.01),
                 ("p=0.95, temp 0.8", "HumanEval", False, 14.1, 5.73, 2.46)],
    },
    "chen_k_sweep": {
        "paper": "Chen et al. 2023", "table": "K sweep figure",
        "notes": {"XSum": "fastest at K = 3; accepted/(K+1) falls with K",
                  "HumanEval": "keeps improving to K = 6-7; accepted/(K+1) falls with K"},
    },
}

# Our prompt sets -> the paper task they stand in for. "news" is real news articles without reference
# summaries, the nearest thing here to the papers' summarisation tasks; "gettext_ende" is English ->
# German Django gettext messages (the embedded T5 experiment's evaluation set), short UI strings rather
# than WMT news, and "heldout_catalogs" the same kind of messages from the wagtail, django-allauth and
# sphinx catalogs (the T5 EnDe experiment's); the label says which it was.
LEVIATHAN_TASK = {"ende": "EnDe", "wmt_ende": "EnDe", "gettext_ende": "EnDe",
                  "heldout_catalogs": "EnDe", "news": "CNNDM", "cnndm": "CNNDM"}
CHEN_TASK = {"news": "XSum", "xsum": "XSum", "humaneval": "HumanEval"}
