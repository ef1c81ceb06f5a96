"""The tiered weight cache (MISSION M1-M9): device / host / disk tiers, compression, residency."""
