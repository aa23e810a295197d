"""What a run leaves behind, read and written below training, evaluation and the reports (docs/development.md)."""
