"""The tiered weight cache: device / host / disk tiers, compression, residency, variants, prefetch."""
