"""Model building blocks; each picks its backend (torch reference / triton) at construction."""
