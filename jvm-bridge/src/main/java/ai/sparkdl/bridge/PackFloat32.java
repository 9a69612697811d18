package ai.sparkdl.bridge;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;

import org.apache.spark.sql.api.java.UDF1;

/**
 * Packs one row's numeric array into little-endian float32 bytes (issue 20, part 3a: a candidate
 * for delivering fixed-width features as one binary column, which numpy views without copying).
 * Registered as a Java UDF ({@code spark.udf.registerJavaFunction("sparkdl_pack_f32",
 * "ai.sparkdl.bridge.PackFloat32", "binary")}); benchmarks/delivery.py measures it against Spark's
 * own array delivery. Spark hands a Java UDF its array as a Scala Seq of boxed numbers.
 */
public final class PackFloat32 implements UDF1<scala.collection.Seq<Object>, byte[]> {
    private static final long serialVersionUID = 1L;

    @Override
    public byte[] call(scala.collection.Seq<Object> values) {
        if (values == null) {
            return null;
        }
        int n = values.length();
        ByteBuffer out = ByteBuffer.allocate(4 * n).order(ByteOrder.LITTLE_ENDIAN);
        for (int i = 0; i < n; i++) {
            out.putFloat(((Number) values.apply(i)).floatValue());
        }
        return out.array();
    }
}
