"""Text in: named prompt sets (`prompts`), the held-out split they share (`splits`), the offline
gettext translation tasks (`gettext`) and, with the `tasks` extra, seqio / TFDS tasks (`seqio_tasks`)."""
