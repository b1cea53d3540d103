"""Choosing an instance: selection and admission, the policies, and what they know of the
instances' KV caches (the KV-event index, the prompt's block keys)."""
