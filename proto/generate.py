"""Regenerate the Python stubs in allspark_client/_proto from proto/allspark.proto.

    python proto/generate.py [OUT_DIR]

grpc_tools writes `import allspark_pb2`; the stubs live in a package, so that line becomes a
package import. tests/models/test_engine_api.py checks the committed stubs equal this script's output.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(out_dir: str) -> None:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}/proto", f"--python_out={out_dir}",
                    f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", f"{ROOT}/proto/allspark.proto"],
                   check=True)
    path = os.path.join(out_dir, "allspark_pb2_grpc.py")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("import allspark_pb2 as", "from allspark_client._proto import allspark_pb2 as"))


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "allspark_client", "_proto"))
