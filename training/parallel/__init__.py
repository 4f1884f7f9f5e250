"""Data-parallel strategies written here (DDP, ZeRO-1) beside the library ones."""
