"""The laptop tasks, built with the core at the repository's root: nano (real handwritten digits), nano-compose
(GenEval's questions drawn with digits), nano-edit (edit a real digit as told), and the comparison of every method on
them. Each runs from the repository's root as `python -m tasks.NAME` (docs/tasks.md); a task's model family stays a
`models_<family>.py` at the root, where the registry imports it."""
