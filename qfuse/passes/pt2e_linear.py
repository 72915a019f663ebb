"""pt2e_linear: WIP"""
def run(graph, context):
    pass
