"""The course's helpers: one module per lesson's experiment (compare_engines, hybrid_lesson,
sync_async, ...), the quizzes and `pipelab grade`.  May import everything below the entry
points, pictures included; nothing in the engine imports it."""
