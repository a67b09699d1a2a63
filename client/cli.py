def main():
    print("moestreamctl")
