"""The message vocabulary: small frozen dataclasses that cross a thread or process boundary, torch-free."""
