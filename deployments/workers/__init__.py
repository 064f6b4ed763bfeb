"""The draft side: the draft worker actor, what it does with each round message
(drafting), and loading model runners for either side."""
