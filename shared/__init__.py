"""Code shared by every BubbleTea service: the wire, the bus, config and the pure policies.

Not to be confused with the `../shared` folder of reference material beside the checkout.
"""
